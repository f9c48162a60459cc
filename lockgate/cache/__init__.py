"""The response cache: an in-process LRU bounded in bytes, a Redis tier shared by replicas, and
single-flight coalescing of identical requests in flight, all keyed by one request hash."""
