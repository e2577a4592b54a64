"""LoRA GRPO updates: pure torch math (advantages, losses, KL estimators) plus the Ray Train
worker loop that applies them and publishes adapters."""
