"""hivemind_fixes"""
