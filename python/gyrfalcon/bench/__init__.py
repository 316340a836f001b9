"""Benchmarks of a running gyrfalcon (or any OpenAI-compatible) server.

``gyrfalcon.bench.serving`` is the serving load generator behind
``gyrfalcon bench serve``; its workloads live in ``datasets``, the streamed
HTTP client in ``client`` and the figures it reports in ``metrics``.
"""
