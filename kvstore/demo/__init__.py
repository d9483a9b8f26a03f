"""`kvstore demo`: a synthetic day of traffic through the gRPC API, with failures injected."""
