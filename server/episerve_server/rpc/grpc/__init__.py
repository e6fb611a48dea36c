"""gRPC as a transport of the handlers: their errors as statuses and trailers."""
