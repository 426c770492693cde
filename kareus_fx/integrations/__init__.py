"""Glue for training frameworks that drive ``torch.compile`` themselves (torchtitan)."""
