"""The engine: one step at a time (LLMEngine), the loop that runs it on a thread for the server (EngineLoop), the offline API (LLM)."""
