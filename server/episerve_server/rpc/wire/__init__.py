"""The codec: request bytes to checked values, results to response bytes."""
