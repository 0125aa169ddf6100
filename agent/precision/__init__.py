"""agent.precision"""
