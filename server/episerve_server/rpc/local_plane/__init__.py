"""The shared-memory plane: a transport for clients on the daemon's host, beside gRPC."""
