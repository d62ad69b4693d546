"""defence"""
