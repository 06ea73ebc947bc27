"""The bundled benchmark harness (`pagoda bench serve | throughput | latency`)."""
