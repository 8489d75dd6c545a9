"""From stored units to what a reader sees: the Markdown leaderboard, the HTML page, the regression gate."""
