"""RL frameworks driving rlserve through a small adapter, their loops otherwise unchanged:
Hugging Face TRL (`integrations.trl`). Clients of the SDK; no vLLM, no server code."""
