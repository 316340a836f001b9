"""What one forward pass reads: the batch and its metadata builder, the paged KV
cache, host-to-device uploads, and the rank's tensor-parallel context. Below
`layers/` and `models/`, above `kernels/`; it never imports the worker, scheduler or
frontend."""
