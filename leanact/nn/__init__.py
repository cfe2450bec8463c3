"""Drop-in torch.nn modules built on leanact.ops."""
__all__: list[str] = []
