"""agent.wire"""
