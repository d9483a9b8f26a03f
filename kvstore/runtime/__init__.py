"""Every ray.* call of kvstore: cluster bootstrap (loopback by default), actor shells, handles."""
