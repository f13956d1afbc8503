"""The synthetic corpus: the embedded default data of stage 0 (SRQA, the paper's set, is not public).

A dialogue is a list of rounds (user utterance Q_i, assistant utterance A_i). Facts are stated
early (a membership tier and its rule, prices, who performs what where, order numbers, dates,
addresses), distractor rounds bury them, some facts are updated later (the newer value is
right), same-entity confusers sit beside them (two services, two prices), and the queries at
the end need one, two or three of them combined, or none at all. Each query round carries its
ground truth (H*, Z, A*, answer_keys) under "gold", which stage 0's oracle teacher serves.

The output is the raw dialogue format stage0_build.py reads from every source:
    {"id", "source": "synthetic", "domain", "rounds": [{"user", "assistant", "kind", "gold"?}, ...]}

    generate_synthetic(num_dialogues, seed) -> list of dialogues (same seed, same bytes)
"""
from __future__ import annotations

import random

NAMES = ["Lena", "Marco", "Priya", "Jonas", "Aiko", "Sofia", "Tomas", "Nadia", "Ravi", "Elena", "Omar", "Greta"]
BRANCHES = ["Uptown", "Downtown", "Riverside", "Lakeside", "Midtown", "Harbor", "Westgate", "Hillcrest"]
TIERS = ["Apex", "Gold", "Silver", "Platinum", "Emerald", "Summit", "Azure", "Onyx"]
SERVICES = ["Chakra Balancing", "Deep Tissue Massage", "Hot Stone Therapy", "Aromatherapy Facial",
            "Reflexology Session", "Hydra Glow Facial", "Bamboo Massage", "Salt Scrub Ritual"]
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
TIMES = ["9 am", "10 am", "11 am", "noon", "1 pm", "2 pm", "3 pm", "4 pm", "5 pm", "6 pm"]
MONTHS = ["March", "April", "May", "June", "July", "August", "September", "October"]
ITEMS = ["wireless headphones", "coffee grinder", "yoga mat", "desk lamp", "hiking backpack", "blender",
         "smartwatch", "rain jacket", "air fryer", "bookshelf", "espresso machine", "standing desk"]
STREETS = ["Maple", "Cedar", "Harbor", "Elm", "Willow", "Sunset", "Oak", "Lincoln", "Park", "River"]
CITIES = ["Lisbon", "Denver", "Osaka", "Toronto", "Madrid", "Austin", "Dublin", "Seoul", "Oslo", "Nairobi"]
HOTELS = ["Grand Harbor Hotel", "Maple Inn", "Sunset Suites", "Blue Lagoon Resort", "City Loft Hotel", "Alpine Lodge"]
PLANS = ["Unlimited Plus", "Basic 10", "Family Share", "Value 25", "Premium 50", "Starter Lite"]


def _pick(rng, options):
    return options[rng.randrange(len(options))]


class Round:
    """One round: the user's Q_i, the assistant's A_i, the facts it states ({key: "Q" | "A"}), and
    an optional state change applied when the round is laid out (a knowledge update)."""

    def __init__(self, user, assistant, provides=None, apply=None, kind="fact"):
        self.user, self.assistant, self.kind = user, assistant, kind
        self.provides, self.apply = provides or {}, apply


class QuerySpec:
    """A query that needs the facts `needs`; `make(state)` returns (query, answer, answer_keys,
    analysis, reasoning, derived_yes_no), built from the state at the moment it is asked."""

    def __init__(self, kind, needs, make):
        self.kind, self.needs, self.make = kind, needs, make


def _spa(rng):
    tier, pct, threshold = _pick(rng, TIERS), rng.choice([10, 15, 20, 25]), rng.choice([100, 120, 150, 200])
    service_a, service_b = rng.sample(SERVICES, 2)
    price_a, price_b = rng.randrange(60, 300, 5), rng.randrange(60, 300, 5)
    while price_b == price_a:
        price_b = rng.randrange(60, 300, 5)
    therapist, branch = _pick(rng, NAMES), _pick(rng, BRANCHES)
    s = {"day": _pick(rng, DAYS), "time": _pick(rng, TIMES)}
    new_day, new_time = _pick(rng, [d for d in DAYS if d != s["day"]]), _pick(rng, [t for t in TIMES if t != s["time"]])
    facts = [
        Round(_pick(rng, [f"I need to check my membership status. I'm under {tier} Tier.",
                          f"Hi, I'm {'an' if tier[0] in 'AEIOU' else 'a'} {tier} Tier member and want to book something.",
                          f"Hello! My membership level is {tier} Tier."]),
              _pick(rng, ["Welcome back. I can confirm your membership.", "Thanks, your membership is confirmed.",
                          "Great, I have found your member profile."]), {"tier": "Q"}),
        Round(_pick(rng, ["What perks come with my tier?", "Does my membership give me any discount?",
                          "Remind me what my tier includes?"]),
              _pick(rng, [f"{tier} Tier gives you {pct}% off any service over ${threshold}.",
                          f"With {tier} Tier you get a {pct}% discount on services priced above ${threshold}.",
                          f"Members at {tier} Tier save {pct}% on any treatment that costs more than ${threshold}."]),
              {"rule": "A"}),
        Round(_pick(rng, [f"How much is the {service_a}?", f"What does the {service_a} cost?",
                          f"Could you tell me the price of the {service_a}?"]),
              _pick(rng, [f"The {service_a} is ${price_a}.", f"The {service_a} costs ${price_a}.",
                          f"Our {service_a} is priced at ${price_a}."]), {"price_a": "A"}),
        Round(_pick(rng, [f"And the {service_b}?", f"What about the {service_b}, how much is that?",
                          f"Is the {service_b} more expensive?"]),
              _pick(rng, [f"The {service_b} is ${price_b}.", f"The {service_b} costs ${price_b}.",
                          f"We charge ${price_b} for the {service_b}."]), {"price_b": "A"}),
        Round(_pick(rng, [f"Who performs the {service_a}?", f"Which therapist does the {service_a}?",
                          f"Is there a specialist for the {service_a}?"]),
              _pick(rng, [f"Our senior therapist, {therapist}, is the specialist for the {service_a}.",
                          f"{therapist} performs the {service_a}; they designed that treatment.",
                          f"That would be {therapist}, our {service_a} specialist."]), {"therapist": "A"}),
        Round(_pick(rng, [f"Which branch does {therapist} work at?", f"Where can I find {therapist}?",
                          f"And which location is {therapist} based at?"]),
              _pick(rng, [f"{therapist} only offers that service at our {branch} branch.",
                          f"{therapist} works at the {branch} branch.",
                          f"You'll find {therapist} at our {branch} location."]), {"branch": "A"}),
        Round(_pick(rng, [f"Can I book the {service_a} for {s['day']} at {s['time']}?",
                          f"Please put me down for {s['day']} at {s['time']}."]),
              _pick(rng, [f"Done, you're booked for {s['day']} at {s['time']}.",
                          f"Your appointment is set for {s['day']} at {s['time']}."]), {"appointment": "A"}),
    ]
    updates = {"appointment": Round(
        _pick(rng, [f"Actually, could we move it to {new_day} at {new_time}?",
                    f"Something came up. Can I switch to {new_day} at {new_time} instead?"]),
        _pick(rng, [f"No problem, your appointment is now {new_day} at {new_time}.",
                    f"I've moved you to {new_day} at {new_time}."]),
        {"appointment": "A"}, apply=lambda st: st.update(day=new_day, time=new_time), kind="update")}

    def discount(st):
        applies = price_a > threshold
        verdict = (f"Yes. The {service_a} is ${price_a}, which is over ${threshold}, so your {pct}% {tier} Tier discount applies."
                   if applies else
                   f"No. The {service_a} is ${price_a}, which is not over ${threshold}, so the {pct}% discount does not apply.")
        return (_pick(rng, [f"For that {service_a} booking, will my discount apply?",
                            f"Great. So will my member discount work on the {service_a}?",
                            f"Do I get my tier discount on the {service_a}?"]), verdict,
                ["yes" if applies else "no", f"${price_a}"],
                f"whether their membership discount applies to the {service_a}",
                f"The user is {tier} Tier; that tier gives {pct}% off services over ${threshold}. The {service_a} "
                f"costs ${price_a}, which is {'over' if applies else 'not over'} ${threshold}, so the discount "
                f"{'applies' if applies else 'does not apply'}.", True)

    def cheaper(st):
        name, price = (service_a, price_a) if price_a < price_b else (service_b, price_b)
        return (_pick(rng, [f"Which is cheaper, the {service_a} or the {service_b}?",
                            f"Between the {service_a} and the {service_b}, which costs less?"]),
                f"The {name} is cheaper, at ${price}.", [name, f"${price}"],
                f"which of the two services costs less",
                f"The {service_a} costs ${price_a} and the {service_b} costs ${price_b}, so the {name} is cheaper.", False)

    queries = [
        QuerySpec("single", ["price_a"], lambda st: (
            _pick(rng, [f"Remind me, how much was the {service_a}?", f"What was the price of the {service_a} again?"]),
            f"The {service_a} is ${price_a}.", [f"${price_a}"], f"for the price of the {service_a}",
            f"The price was stated earlier: the {service_a} is ${price_a}.", False)),
        QuerySpec("pair", ["therapist", "branch"], lambda st: (
            _pick(rng, [f"So who would do my {service_a}, and where?", f"Who am I seeing for the {service_a}, and at which branch?"]),
            f"{therapist} performs it, at the {branch} branch.", [therapist, branch],
            f"who performs the {service_a} and at which branch",
            f"{therapist} is the {service_a} specialist and works at the {branch} branch.", False)),
        QuerySpec("triple", ["tier", "rule", "price_a"], discount),
        QuerySpec("update", ["appointment"], lambda st: (
            _pick(rng, ["What time is my appointment again?", "When am I booked in?", "Can you confirm my appointment time?"]),
            f"Your appointment is on {st['day']} at {st['time']}.", [st["day"], st["time"]],
            "for the current appointment time",
            f"The most recent booking says {st['day']} at {st['time']}; a later change overrides an earlier one.", False)),
        QuerySpec("pair", ["price_a", "price_b"], cheaper),
    ]
    general = [("Do you sell gift cards?", "Yes, gift cards are available at the front desk in any amount."),
               ("What are your opening hours?", "We are open from 9 am to 8 pm every day."),
               ("Is there parking nearby?", "Yes, every branch has free parking for guests."),
               ("Do I need to bring anything to a session?", "No, we provide robes, towels and slippers.")]
    return "spa", s, facts, updates, queries, general


def _shop(rng):
    order = str(rng.randrange(10000, 99999))
    item_a, item_b = rng.sample(ITEMS, 2)
    price_a, price_b = rng.randrange(15, 400), rng.randrange(15, 400)
    address = f"{rng.randrange(2, 999)} {_pick(rng, STREETS)} Street, {_pick(rng, CITIES)}"
    window = rng.choice([14, 30, 45, 60])
    s = {"date": f"{_pick(rng, MONTHS)} {rng.randrange(1, 29)}"}
    new_date = f"{_pick(rng, MONTHS)} {rng.randrange(1, 29)}"
    facts = [
        Round(_pick(rng, [f"Hi, I'm calling about order #{order}.", f"My order number is {order}.",
                          f"Hello, I have a question about my order, number {order}."]),
              _pick(rng, ["Thanks, I've pulled up your order.", "Sure, I have the order in front of me.",
                          "Got it, the order is open on my screen."]), {"order": "Q"}),
        Round(_pick(rng, [f"I bought the {item_a} for ${price_a}.", f"It has the {item_a}, which was ${price_a}.",
                          f"The {item_a} I paid ${price_a} for is on it."]),
              _pick(rng, [f"I see the {item_a} on the order.", f"Yes, the {item_a} is listed.",
                          f"Right, the {item_a} is there."]), {"price_a": "Q"}),
        Round(_pick(rng, [f"There's also a {item_b} at ${price_b} on it.", f"I also added the {item_b} for ${price_b}."]),
              _pick(rng, [f"Yes, the {item_b} is on the same order.", f"I see the {item_b} as well."]), {"price_b": "Q"}),
        Round(_pick(rng, ["Where is it being shipped?", "Can you confirm the delivery address?"]),
              _pick(rng, [f"It's shipping to {address}.", f"The delivery address on file is {address}."]), {"address": "A"}),
        Round(_pick(rng, ["When should it arrive?", "What's the delivery date?"]),
              _pick(rng, [f"It is scheduled to arrive on {s['date']}.", f"Expected delivery is {s['date']}."]), {"delivery": "A"}),
        Round(_pick(rng, ["What's your return policy?", "How long do I have to return something?"]),
              _pick(rng, [f"You can return items within {window} days of delivery for a full refund.",
                          f"Returns are accepted up to {window} days after delivery, with a full refund."]), {"window": "A"}),
    ]
    updates = {"delivery": Round(
        _pick(rng, ["Is there any update on the shipment?", "Has anything changed with the delivery?"]),
        _pick(rng, [f"Yes, the carrier moved your delivery to {new_date}.", f"Update: it will now arrive on {new_date}."]),
        {"delivery": "A"}, apply=lambda st: st.update(date=new_date), kind="update")}
    days_since = rng.randrange(3, 70)

    def can_return(st):
        ok = days_since <= window
        answer = (f"Yes. {days_since} days is within the {window}-day window, so you would get back ${price_a}."
                  if ok else f"No. {days_since} days is past the {window}-day return window, so the ${price_a} cannot be refunded.")
        return (_pick(rng, [f"It's been {days_since} days since delivery. Can I still return the {item_a} for a full refund?",
                            f"If I send the {item_a} back now, {days_since} days after delivery, do I get my money back?"]),
                answer, ["yes" if ok else "no", f"${price_a}"],
                f"whether the {item_a} can still be returned for a refund",
                f"The return window is {window} days and it has been {days_since} days; the {item_a} cost ${price_a}.", True)

    queries = [
        QuerySpec("single", ["order"], lambda st: (
            _pick(rng, ["What was my order number again?", "Can you remind me of my order number?"]),
            f"Your order number is {order}.", [order], "for their order number",
            f"The user gave the order number at the start: {order}.", False)),
        QuerySpec("single", ["address"], lambda st: (
            _pick(rng, ["Where is the package going?", "Which address will it be delivered to?"]),
            f"It is going to {address}.", [address], "for the delivery address",
            f"The delivery address on file is {address}.", False)),
        QuerySpec("update", ["delivery"], lambda st: (
            _pick(rng, ["So when will it arrive?", "What's the latest delivery date?"]),
            f"It should arrive on {st['date']}.", [st["date"]], "for the current delivery date",
            f"The latest delivery date given is {st['date']}; it replaces any earlier date.", False)),
        QuerySpec("pair", ["window", "price_a"], can_return),
        QuerySpec("pair", ["order", "address"], lambda st: (
            _pick(rng, ["For my records, what's the order number and where is it shipping?",
                        "Can you confirm both the order number and the address?"]),
            f"Order {order} is shipping to {address}.", [order, address], "for the order number and the shipping address",
            f"The order number is {order} and the address on file is {address}.", False)),
        QuerySpec("single", ["price_b"], lambda st: (
            _pick(rng, [f"How much did I pay for the {item_b}?", f"What did the {item_b} cost me?"]),
            f"The {item_b} was ${price_b}.", [f"${price_b}"], f"for the price of the {item_b}",
            f"The user said the {item_b} was ${price_b}.", False)),
    ]
    general = [("Do you offer gift wrapping?", "Yes, gift wrapping is available at checkout for $5."),
               ("Do you ship internationally?", "Yes, we ship to over 40 countries."),
               ("Can I pay with PayPal?", "Yes, we accept PayPal and all major cards."),
               ("Do you have a loyalty program?", "Yes, you earn one point for every dollar spent.")]
    return "shop", s, facts, updates, queries, general


def _travel(rng):
    ref = "".join(rng.choice("ABCDEFGHJKLMNPQRSTUVWXYZ23456789") for _ in range(6))
    flight = f"{rng.choice(['TK', 'LH', 'BA', 'AF', 'UA', 'QF'])}{rng.randrange(100, 9999)}"
    city, hotel, nights = _pick(rng, CITIES), _pick(rng, HOTELS), rng.randrange(2, 9)
    seat, bags = f"{rng.randrange(3, 40)}{rng.choice('ABCDEF')}", rng.choice([1, 2])
    s = {"date": f"{_pick(rng, MONTHS)} {rng.randrange(1, 29)}", "time": _pick(rng, TIMES)}
    new_time = _pick(rng, [t for t in TIMES if t != s["time"]])
    facts = [
        Round(_pick(rng, [f"I'm flying to {city} on flight {flight}.", f"I have a trip to {city}, flight {flight}."]),
              _pick(rng, [f"Great, I found flight {flight} to {city}.", f"Thanks, flight {flight} is on my screen."]), {"flight": "Q"}),
        Round(_pick(rng, ["What's my booking reference?", "Can I get the reference for this booking?"]),
              _pick(rng, [f"Your booking reference is {ref}.", f"The reference code is {ref}."]), {"ref": "A"}),
        Round(_pick(rng, ["When does the flight leave?", "What time is departure?"]),
              _pick(rng, [f"Flight {flight} departs on {s['date']} at {s['time']}.",
                          f"It leaves on {s['date']} at {s['time']}."]), {"departure": "A"}),
        Round(_pick(rng, [f"I also booked the {hotel} for {nights} nights.", f"My hotel is the {hotel}, {nights} nights."]),
              _pick(rng, ["Noted, I've linked the hotel to your trip.", "Thanks, the hotel is added to your itinerary."]), {"hotel": "Q"}),
        Round(_pick(rng, ["Do I have a seat assigned?", "Which seat did I get?"]),
              _pick(rng, [f"You're in seat {seat}.", f"Seat {seat} is assigned to you."]), {"seat": "A"}),
        Round(_pick(rng, ["How much luggage can I check?", "What's my baggage allowance?"]),
              _pick(rng, [f"Your fare includes {bags} checked bag{'s' if bags > 1 else ''} of up to 23 kg.",
                          f"You can check {bags} bag{'s' if bags > 1 else ''}, 23 kg each."]), {"bags": "A"}),
    ]
    updates = {"departure": Round(
        _pick(rng, ["Any changes to my flight?", "Is my flight still on time?"]),
        _pick(rng, [f"The airline rescheduled it: it now departs at {new_time}.",
                    f"There's a schedule change; departure is now {new_time}."]),
        {"departure": "A"}, apply=lambda st: st.update(time=new_time), kind="update")}
    want_bags = rng.choice([1, 2, 3])

    def bag_check(st):
        ok = want_bags <= bags
        return (_pick(rng, [f"Can I bring {want_bags} checked bag{'s' if want_bags > 1 else ''} at no cost?",
                            f"Is it fine if I check {want_bags} bag{'s' if want_bags > 1 else ''}?"]),
                f"{'Yes' if ok else 'No'}. Your fare includes {bags} checked bag{'s' if bags > 1 else ''}, "
                f"so {want_bags} {'is' if ok else 'is not'} covered.",
                ["yes" if ok else "no"], "whether their checked bags are covered",
                f"The fare includes {bags} checked bag{'s' if bags > 1 else ''}; the user wants {want_bags}.", True)

    queries = [
        QuerySpec("single", ["ref"], lambda st: (
            _pick(rng, ["What's my booking reference again?", "Remind me of the reference code?"]),
            f"Your booking reference is {ref}.", [ref], "for the booking reference",
            f"The reference given earlier is {ref}.", False)),
        QuerySpec("update", ["departure"], lambda st: (
            _pick(rng, ["So what time do I leave now?", "What's the current departure time?"]),
            f"You now depart at {st['time']}.", [st["time"]], "for the current departure time",
            f"The latest departure time is {st['time']}; it overrides the earlier schedule.", False)),
        QuerySpec("pair", ["hotel", "flight"], lambda st: (
            _pick(rng, ["Which flight am I on and where am I staying?", "Remind me of my flight and my hotel?"]),
            f"You're on flight {flight} and staying at the {hotel} for {nights} nights.", [flight, hotel],
            "for their flight and their hotel", f"The flight is {flight}; the hotel is the {hotel}, {nights} nights.", False)),
        QuerySpec("pair", ["seat", "ref"], lambda st: (
            _pick(rng, ["What seat do I have, and what's the booking reference?", "Give me my seat and reference code, please."]),
            f"Seat {seat}, booking reference {ref}.", [seat, ref], "for the seat and the booking reference",
            f"The seat is {seat} and the reference is {ref}.", False)),
        QuerySpec("single", ["bags"], bag_check),
    ]
    general = [("Is there Wi-Fi on board?", "Yes, Wi-Fi is available on all our long-haul flights."),
               ("Can I bring a pet?", "Small pets can travel in the cabin for a fee of $75."),
               ("Do you offer travel insurance?", "Yes, you can add travel insurance for $29."),
               ("How early should I get to the airport?", "We recommend arriving two hours before departure.")]
    return "travel", s, facts, updates, queries, general


def _telecom(rng):
    account = str(rng.randrange(1000, 9999))
    plan, new_plan = rng.sample(PLANS, 2)
    s = {"plan": plan, "fee": rng.randrange(15, 90)}
    new_fee = rng.randrange(15, 90)
    data_gb, bill_day, card = rng.choice([5, 10, 20, 50]), rng.randrange(1, 28), str(rng.randrange(1000, 9999))
    facts = [
        Round(_pick(rng, [f"Hi, my account number ends in {account}.", f"Hello, account ending {account} here."]),
              _pick(rng, ["Thanks, I've verified your account.", "Got it, your account is open."]), {"account": "Q"}),
        Round(_pick(rng, ["Which plan am I on?", "Can you check my current plan?"]),
              _pick(rng, [f"You're on the {plan} plan at ${s['fee']} per month.",
                          f"Your plan is {plan}, which costs ${s['fee']} a month."]), {"plan": "A"}),
        Round(_pick(rng, ["How much data do I get?", "What's my data allowance?"]),
              _pick(rng, [f"Your plan includes {data_gb} GB of data each month.", f"You get {data_gb} GB per month."]), {"data": "A"}),
        Round(_pick(rng, ["When is my bill issued?", "What day do I get billed?"]),
              _pick(rng, [f"Your bill is issued on day {bill_day} of each month.", f"Billing happens on day {bill_day} every month."]),
              {"bill_day": "A"}),
        Round(_pick(rng, [f"Please use my card ending in {card} for autopay.", f"I want autopay on the card ending {card}."]),
              _pick(rng, ["Done, autopay is set up.", "Autopay is now active."]), {"card": "Q"}),
    ]
    updates = {"plan": Round(
        _pick(rng, [f"I'd like to switch to the {new_plan} plan.", f"Can you move me to {new_plan}?"]),
        _pick(rng, [f"Done. You're now on {new_plan} at ${new_fee} per month.",
                    f"I've switched you to {new_plan}; it costs ${new_fee} a month."]),
        {"plan": "A"}, apply=lambda st: st.update(plan=new_plan, fee=new_fee), kind="update")}
    usage = rng.choice([3, 8, 15, 30, 60])

    def over_limit(st):
        over = usage > data_gb
        return (_pick(rng, [f"If I use {usage} GB this month, will I go over?", f"Would {usage} GB exceed my allowance?"]),
                f"{'Yes' if over else 'No'}. Your allowance is {data_gb} GB, so {usage} GB "
                f"{'goes over it' if over else 'stays within it'}.", ["yes" if over else "no"],
                "whether their planned usage exceeds the data allowance",
                f"The allowance is {data_gb} GB and the user plans {usage} GB.", True)

    queries = [
        QuerySpec("single", ["account"], lambda st: (
            _pick(rng, ["Which account number did I give you?", "What are the last digits of my account again?"]),
            f"Your account number ends in {account}.", [account], "for their account number",
            f"The user said the account ends in {account}.", False)),
        QuerySpec("update", ["plan"], lambda st: (
            _pick(rng, ["How much do I pay per month now?", "What's my monthly fee at the moment?"]),
            f"You're on {st['plan']} at ${st['fee']} per month.", [f"${st['fee']}"], "for their current monthly fee",
            f"The latest plan is {st['plan']} at ${st['fee']} per month; it replaces the earlier plan.", False)),
        QuerySpec("pair", ["bill_day", "card"], lambda st: (
            _pick(rng, ["When am I billed and which card pays it?", "Remind me of my billing day and the autopay card?"]),
            f"You're billed on day {bill_day}, paid by the card ending in {card}.", [str(bill_day), card],
            "for the billing day and the autopay card", f"Billing is on day {bill_day}; autopay uses the card ending {card}.", False)),
        QuerySpec("single", ["data"], over_limit),
        QuerySpec("pair", ["account", "bill_day"], lambda st: (
            _pick(rng, ["Confirm my account and billing day, please.", "What's my account number and my billing day?"]),
            f"Account ending {account}, billed on day {bill_day}.", [account, str(bill_day)],
            "for the account number and the billing day", f"The account ends in {account}; billing is on day {bill_day}.", False)),
    ]
    general = [("Do you have 5G coverage?", "Yes, 5G covers all major cities on our network."),
               ("Can I keep my number if I switch?", "Yes, number transfer is free."),
               ("Is there a contract?", "No, all our plans are month to month."),
               ("Do you sell phones?", "Yes, we sell phones with monthly payment options.")]
    return "telecom", s, facts, updates, queries, general


DOMAINS = [_spa, _shop, _travel, _telecom]
SMALL_TALK = [("Thanks, that's helpful.", "You're welcome!"), ("How's your day going?", "Busy but good, thanks for asking."),
              ("Sorry, my internet is slow today.", "No worries, take your time."), ("Hold on one second.", "Of course."),
              ("By the way, nice weather today.", "It really is, enjoy it!"), ("Okay, got it.", "Great."),
              ("Let me think about that.", "Take all the time you need."), ("You've been very patient.", "Happy to help.")]
# (nominal rounds of the bucket, rounds range): short dialogues are drawn more often so every
# Table 3 bucket holds a similar share of the queries.
LENGTH_PLAN = [(8, (8, 11), 0.30), (16, (14, 19), 0.25), (24, (22, 27), 0.19), (32, (31, 32), 0.26)]


def _history_label(side, round_index):
    return f"{side}{round_index}"


def generate_dialogue(index: int, seed: int) -> dict:
    """One synthetic dialogue in the raw source format (see read_dialogues): rounds of
    user/assistant text; query rounds carry their ground truth under "gold"."""
    rng = random.Random(f"{seed}-{index}")
    domain, state, facts, updates, queries, general = rng.choice(DOMAINS)(rng)
    _, (low, high), _ = rng.choices(LENGTH_PLAN, weights=[w for *_, w in LENGTH_PLAN])[0]
    num_rounds = rng.randint(low, high)

    # Which queries, and so which facts, this dialogue needs. Their needs are disjoint: an answer
    # restates the facts it used, so a later query on the same fact could recall that answer
    # instead, and H* would no longer be the unique minimal set.
    num_queries = 2 + num_rounds // 10
    chosen, used = [], set()
    for q in sorted(queries, key=lambda q: rng.random() * 2.5 - len(q.needs)):  # multi-fact first, mostly
        if len(chosen) < num_queries and not used & set(q.needs):
            chosen.append(q)
            used |= set(q.needs)
    needed = {k for q in chosen for k in q.needs}
    fact_rounds = [f for f in facts if set(f.provides) & needed]
    spare = [f for f in facts if not set(f.provides) & needed]
    rng.shuffle(spare)
    update_rounds = [updates[k] for k in updates if k in needed and rng.random() < 0.7]
    general_queries = rng.sample(general, 1 if num_rounds < 20 else 2) if rng.random() < 0.5 else []

    # Lay out: facts spread over the first two thirds of the setup, each update after the fact it
    # changes, distractors everywhere else, the queries at the end.
    query_region = len(chosen) + len(general_queries)
    setup_size = num_rounds - query_region
    while len(fact_rounds) + len(update_rounds) > setup_size and update_rounds:
        update_rounds.pop()
    fact_rounds += spare[:max(0, setup_size - len(fact_rounds) - len(update_rounds) - max(1, setup_size // 3))]
    fact_rounds.sort(key=facts.index)
    fact_span = max(len(fact_rounds), (2 * setup_size) // 3 - len(update_rounds))
    fact_slots = [0] + sorted(rng.sample(range(1, fact_span), len(fact_rounds) - 1))
    setup = [None] * setup_size
    for slot, r in zip(fact_slots, fact_rounds):
        setup[slot] = r
    for r in update_rounds:
        key = next(iter(r.provides))
        after = next(i for i, f in enumerate(setup) if f is not None and key in f.provides)
        free = [i for i in range(after + 1, setup_size) if setup[i] is None]
        setup[rng.choice(free)] = r
    asked = {q for q, _ in general_queries}
    small_talk_or_service = [g for g in general if g[0] not in asked]
    setup = [r if r is not None else Round(*rng.choice(SMALL_TALK if rng.random() < 0.6 else small_talk_or_service),
                                           kind="distractor") for r in setup]
    tail = [("query", q) for q in chosen] + [("general", g) for g in general_queries]
    rng.shuffle(tail)

    rounds, latest = [], {}
    for r in setup:
        if r.apply:
            r.apply(state)
        for key, side in r.provides.items():
            latest[key] = _history_label(side, len(rounds) + 1)
        rounds.append({"user": r.user, "assistant": r.assistant, "kind": r.kind})
    for kind, item in tail:
        t = len(rounds) + 1
        if kind == "general":
            user, answer = item
            gold = {"recall": [], "answer_keys": [answer.rstrip(".")], "derived_yes_no": False,
                    "query_type": "none",
                    "analysis": "a general question about our services",
                    "reasoning": "This is general service information; nothing from earlier in the conversation is needed."}
        else:
            user, answer, keys, analysis, reasoning, derived = item.make(state)
            recall = sorted({latest[k] for k in item.needs}, key=lambda l: (int(l[1:]), l[0] == "A"))
            gold = {"recall": recall, "answer_keys": keys, "derived_yes_no": derived, "query_type": item.kind,
                    "analysis": analysis, "reasoning": reasoning}
        rounds.append({"user": user, "assistant": answer, "kind": kind, "gold": gold})
    return {"id": f"synthetic-{index:06d}", "source": "synthetic", "domain": domain, "rounds": rounds}


def generate_synthetic(num_dialogues: int, seed: int = 0) -> list[dict]:
    return [generate_dialogue(i, seed) for i in range(num_dialogues)]
