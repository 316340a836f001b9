"""What one forward pass reads: the batch and its metadata builder, the paged KV
cache, and host-to-device uploads. Below `layers/` and `models/`, above `kernels/`;
it never imports the worker, scheduler or frontend."""
