"""The live terminal view (Textual).  The only package besides tests that imports textual."""
