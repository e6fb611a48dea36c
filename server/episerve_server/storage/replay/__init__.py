"""Diffusion Policy replay buffers (one zarr format 2 group, episodes concatenated)."""
