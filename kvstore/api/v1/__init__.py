"""Generated from proto/kvstore/v1/kvstore.proto by kvstore.api.codegen. Do not edit."""
