"""One step's time and memory per rank from a calibration: links, collectives, prediction."""
