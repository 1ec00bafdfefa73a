"""The toy world's shared lexicon: every database draws its table, column and value names from these lists,
so unseen databases have new schemas made of known words (see toy.py)."""

from __future__ import annotations

FIRST = ("Alice Bruno Carla Diego Elena Felix Greta Hugo Irene Jonas Karin Leo Maria Nils Olga Pablo Rita "
         "Sven Tara Victor Wanda Yusuf Zoe Anton Bianca Conrad Dora Emil Frida Gustav").split()
LAST = ("Moreau Novak Rossi Berg Costa Lindqvist Weber Silva Kowalski Dubois Jensen Ferrari Horvat Meyer "
        "Santos Larsen Fischer Romano Nowak Petit Varga Olsen Lopez Marek Keller Brandt Ricci Holm").split()
ADJ = ("Silent Golden Hidden Broken Bright Distant Silver Northern Quiet Crimson Wild Frozen Lost Hollow "
       "Burning Gentle Iron Velvet Endless Autumn Secret Lucky Royal Emerald").split()
NOUN = ("River Garden Harbor Forest Mountain Tower Bridge Island Valley Crown Lantern Meadow Shadow Ocean "
        "Falcon Orchard Castle Canyon Compass Comet Anchor Summit Willow Horizon").split()
MATERIAL = "Oak Steel Glass Cotton Leather Copper Bamboo Marble Wool Linen Ceramic Walnut".split()
OBJECT = "Lamp Chair Table Mug Bag Clock Shelf Vase Desk Jacket Kettle Basket Mirror Rug".split()
POOLS = {
    "city": "Paris Lyon Berlin Madrid Rome Vienna Oslo Lisbon Dublin Prague Warsaw Athens".split(),
    "country": "France Germany Spain Italy Austria Norway Portugal Ireland Poland Greece Canada Japan".split(),
    "status": "active pending closed cancelled completed".split(),
    "color": "red blue green black white yellow".split(),
    "genre": "drama comedy thriller romance fantasy mystery jazz rock pop folk".split(),
    "level": "beginner intermediate advanced expert".split(),
    "department": "sales finance research marketing support legal".split(),
    "specialty": "cardiology surgery pediatrics radiology neurology oncology".split(),
    "category": "books toys garden kitchen sports music office tools".split(),
    "position": "goalkeeper defender midfielder forward".split(),
    "region": "north south east west central".split(),
    "size": "small medium large".split(),
    "language": "English French German Spanish Italian".split(),
    "payment": "cash card transfer voucher".split(),
    "term": "spring summer autumn winter".split(),
    "role": "lead support analyst engineer designer guest".split(),
    "grade": "A B C D E".split(),
    "room_type": "single double suite family".split(),
}
# column word -> (SQL type, generator): ("int"|"real", lo, hi[, decimals]) or ("date", first year, last year)
NUMERIC = {
    "age": ("int", 18, 80), "price": ("real", 2, 500, 2), "stock": ("int", 0, 250), "quantity": ("int", 1, 12),
    "rating": ("real", 1, 5, 1), "pages": ("int", 80, 900), "year": ("int", 1960, 2023),
    "capacity": ("int", 50, 900), "credits": ("int", 1, 8), "score": ("int", 0, 100),
    "duration": ("int", 2, 240), "distance": ("int", 100, 9000), "budget": ("int", 10000, 2000000),
    "cost": ("real", 10, 3000, 2), "fee": ("real", 50, 5000, 2), "stars": ("int", 1, 5), "nights": ("int", 1, 14),
    "height": ("real", 1.5, 2.1, 2), "play_count": ("int", 0, 1000000), "salary": ("int", 20000, 180000),
    "seats": ("int", 20, 400), "floor": ("int", 1, 30), "discount": ("real", 0, 30, 1),
    "founding_year": ("int", 1880, 2020), "headcount": ("int", 5, 5000), "amount": ("real", 5, 2000, 2),
    "points": ("int", 0, 100), "goals": ("int", 0, 40), "track_count": ("int", 5, 20), "hours": ("int", 1, 60),
    "fleet_size": ("int", 5, 400),
}
DATES = {
    "birth_date": (1950, 2005), "join_date": (2015, 2024), "hire_date": (2000, 2024), "start_date": (2015, 2024),
    "end_date": (2016, 2025), "release_date": (1990, 2024), "visit_date": (2018, 2024),
    "loan_date": (2019, 2024), "return_date": (2019, 2024), "flight_date": (2020, 2024),
    "check_in": (2020, 2024), "order_date": (2018, 2024), "event_date": (2016, 2024),
}
NO_SUM = {"age", "rating", "year", "founding_year", "stars", "height", "floor", "score", "credits", "discount"}
IRREGULAR = {"staff": "staff", "quarters": "quarters"}

# domain -> table slots: (name synonyms, label column:generator or "", candidate columns, parent slots).
# A trailing "?" makes a column NULL-able. Parents come before children; fact tables have no label.
DOMAINS = {
    "shop": [("supplier vendor maker", "name:title", "country city rating? founding_year", ()),
             ("customer client buyer", "name:person", "city country age email? join_date region", ()),
             ("product item article", "name:product", "category color price stock rating? size", (0,)),
             ("purchase sale shipment", "", "quantity status amount payment discount? order_date", (1, 2))],
    "school": [("student pupil learner", "name:person", "age city birth_date email? level", ()),
               ("teacher instructor tutor", "name:person", "department salary hire_date email? age", ()),
               ("course module subject", "title:title", "credits level term capacity", (1,)),
               ("enrollment registration attendance", "", "score? grade status join_date", (0, 2))],
    "library": [("author writer novelist", "name:person", "country birth_date? language age?", ()),
                ("book novel volume", "title:title", "genre pages price year rating? language", (0,)),
                ("member reader patron", "name:person", "city email? join_date age", ()),
                ("loan checkout borrowing", "", "loan_date return_date? fee? status", (1, 2))],
    "airline": [("airline carrier operator", "name:title", "country founding_year fleet_size rating?", ()),
                ("airport terminal hub", "name:title", "city country capacity", ()),
                ("flight route trip", "", "distance duration price status flight_date seats", (0, 1)),
                ("pilot captain aviator", "name:person", "age salary hire_date? level", (0,))],
    "hospital": [("ward unit clinic", "name:title", "floor capacity specialty", ()),
                 ("doctor physician surgeon", "name:person", "specialty salary hire_date age", (0,)),
                 ("patient client resident", "name:person", "age city birth_date email?", ()),
                 ("visit appointment consultation", "", "visit_date cost status duration payment", (1, 2))],
    "music": [("artist band singer", "name:person", "country genre founding_year", ()),
              ("album record collection", "title:title", "year price rating? genre track_count", (0,)),
              ("song track single", "title:title", "duration play_count rating? language", (1,)),
              ("concert show gig", "", "city capacity price event_date status", (0,))],
    "sports": [("team club squad", "name:title", "city founding_year budget? region", ()),
               ("player athlete member", "name:person", "age position salary height goals?", (0,)),
               ("coach manager trainer", "name:person", "age salary hire_date? level", (0,)),
               ("game fixture contest", "", "points goals city event_date status", (0,))],
    "hotel": [("hotel inn resort", "name:title", "city country stars rating? capacity", ()),
              ("guest visitor traveler", "name:person", "country age email? language", ()),
              ("booking reservation stay", "", "check_in nights amount status payment discount?", (0, 1)),
              ("room cabin chamber", "", "floor price room_type size", (0,))],
    "company": [("branch office site", "name:title", "city region budget headcount start_date", ()),
                ("employee worker staff", "name:person", "department salary hire_date age email? level", (0,)),
                ("project initiative program", "title:title", "budget start_date end_date? status", (0,)),
                ("assignment task duty", "", "hours role status start_date", (1, 2))],
}


def plural(word: str) -> str:
    if word in IRREGULAR:
        return IRREGULAR[word]
    if word.endswith("y") and word[-2] not in "aeiou":
        return word[:-1] + "ies"
    return word + ("es" if word.endswith(("s", "x", "ch", "sh")) else "s")


def an(word: str) -> str:
    return ("an " if word[0] in "aeiou" else "a ") + word


def human(column: str) -> str:
    return column.replace("_", " ")
