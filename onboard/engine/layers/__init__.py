"""Model pieces the engine families share: norms, MLPs, attention types, MoE blocks."""
