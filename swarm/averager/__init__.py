"""averager"""
