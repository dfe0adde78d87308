//! vLLM simulator
