"""An embedding whose backward takes a tied language-model head's weight gradient: the tied weight's
gradient made once, without a second dense V × H tensor.

- :mod:`.function`: the autograd Function and :func:`tied_embedding`;
- :mod:`.tied_grad`: when a head may give its dW to the embedding's node, and how.
"""
from .function import TiedEmbeddingFunction, tied_embedding
from .tied_grad import hand_off, handed_off

__all__ = ["TiedEmbeddingFunction", "tied_embedding", "hand_off", "handed_off"]
