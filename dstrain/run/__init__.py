"""What keeps a run alive and its files safe, and what notices when it goes wrong without a sound."""
