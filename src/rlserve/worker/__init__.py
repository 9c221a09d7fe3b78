"""What runs inside vLLM's processes (its engine core and workers): rlserve's vLLM plugins,
the worker extension the server drives through `collective_rpc`, the receiving half of
rlserve's transports, the shadow update, the served-weight digests and the gloo helper
process. It imports the shared formats (`rlserve.wire`), the vocabulary and vLLM."""
