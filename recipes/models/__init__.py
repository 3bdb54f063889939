"""Plain ``nn.Module`` networks used by the recipe tasks (no Lightning here)."""
from recipes.models.cnn import DigitsCNN
from recipes.models.gpt import GPT

__all__ = ["DigitsCNN", "GPT"]
