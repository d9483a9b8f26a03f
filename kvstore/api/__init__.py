"""gRPC API: servicer, server, client; v1/ holds generated code (do not edit)."""
