"""The rank's training loop and what it asks of a backend: protocols, breakdown, trace, LR schedule, generation."""
