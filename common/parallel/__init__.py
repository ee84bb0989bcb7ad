"""How ranks share the work: each strategy's layout and cost, and pipeline schedules."""
