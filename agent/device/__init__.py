"""agent.device"""
