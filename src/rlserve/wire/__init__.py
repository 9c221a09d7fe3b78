"""Formats every process shares: the transfer protocol (chunks, manifests, patches, digests),
the shared-memory segment's layout and the gloo group the trainer and the workers form. Pure
data and torch; no grpc, no vLLM."""
