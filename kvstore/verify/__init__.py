"""Executable checks on a small V4-style torch model: YoCo mask vs compact, bounded replay."""
