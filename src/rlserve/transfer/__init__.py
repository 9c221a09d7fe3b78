"""Weight transports: rlserve's own `rlserve_gloo` backend for vLLM (CPU and GPU hosts) and
the pieces both the trainer and the inference worker share."""
