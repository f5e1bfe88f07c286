"""What the text tasks share: reading UTF-8 rows and tokenising them."""
