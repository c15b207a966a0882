"""The model: loading it, its layers, and running it on the paged KV cache."""
