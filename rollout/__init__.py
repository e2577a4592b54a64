"""Generation: one engine interface (vLLM or transformers), a Ray Serve deployment of engine
replicas, and the per-step LoRA adapter sync between learner and replicas."""
