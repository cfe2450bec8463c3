"""Command-line interface (`leanact ...`)."""
