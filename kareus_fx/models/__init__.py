"""Reference models of the Kareus paper, built from their published configs (no weights)."""
