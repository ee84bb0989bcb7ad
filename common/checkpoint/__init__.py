"""Checkpoints both frameworks read and write: HF files, sharded files, and tensor sources read slice by slice."""
