"""Where stage 0's dialogues come from (§3.2), and who annotates them:

synthetic            the embedded synthetic corpus: generate_synthetic assembles its dialogues
synthetic_common     what its four domains share: word lists, draws, the twins' plan, the
                     checks that keep the gold unique, the small talk, the round and query types
synthetic_spa        the spa domain (the paper's Fig. 1 kind of dialogue)
synthetic_shop       the shop domain (orders, deliveries, returns)
synthetic_travel     the travel domain (flights, hotels, bags)
synthetic_telecom    the telecom domain (plans, devices, data)
corpora              readers for LoCoMo, CoQA, MultiWOZ, DailyDialog, ReDial, MG-ShopDial, chit-chat, JSONL
teacher              the LLM teachers of §3.2 and the chat-API client
leakage              the checks that no test answer can be looked up in train, without the history
"""
