"""`lockgate route`: one address in front of many replicas (balancing, health, retries within a
budget, hedging, coordinated shedding)."""
