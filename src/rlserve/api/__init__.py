"""Generated gRPC stubs: do not edit. Regenerate with scripts/gen_protos.py."""
