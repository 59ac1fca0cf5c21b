"""Framework integrations: checkpoint to a bucket from the frameworks users train with."""
