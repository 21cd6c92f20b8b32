"""Training-data synthesis: operator catalogue, composers, filters, decontamination, datasets."""
