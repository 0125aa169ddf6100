"""agent.engines"""
