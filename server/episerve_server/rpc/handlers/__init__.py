"""What each RPC does, for the gRPC server and the local plane alike."""
