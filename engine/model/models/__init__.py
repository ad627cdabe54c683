"""Model implementations (Llama-family decoder-only transformers)."""
