def answer(text):
    return str(text).strip().rstrip(".").replace(" ", "")
