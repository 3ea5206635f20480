"""vitserve.cache: embedding stores and their wire format (numpy, msgpack, redis; never torch)."""
