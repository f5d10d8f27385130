"""pFedPrompt (being written)."""
