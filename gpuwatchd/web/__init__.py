"""The /metrics HTTP(S) server (server), its web-config file (config) and its connection loop
(listener).
"""
